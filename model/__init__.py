"""The PyTorch side of attnserve: tokenizer, GPT, training and checkpoints.

Importing this package stays cheap (no torch) so the command line can list subcommands
in an environment that only has the serving extra installed.
"""
