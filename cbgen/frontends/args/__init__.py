"""Argument groups shared by the command-line front ends (precision, speculation, structured output)."""
