"""What exactly one notebook (02 to 05) needs and no library user calls."""
