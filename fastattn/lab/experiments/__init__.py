"""What exactly one notebook (02 to 04) needs and no library user calls."""
