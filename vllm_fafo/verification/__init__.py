"""Draft trees: branches off each draft, their layout and acceptance."""
