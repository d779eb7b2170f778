"""Command-line tools that build the test model, prompts and tables; never imported while serving."""
