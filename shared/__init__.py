"""Code both ds3 processes use: protocol rules, offsets, errors, config."""
