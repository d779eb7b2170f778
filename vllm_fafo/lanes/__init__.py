"""Fumble lanes: the step planner, lane state, the step plan the attention layers read, compression policies."""
