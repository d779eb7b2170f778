"""The goodput controller and the draft judge it learns from."""
