"""Requests, their sampling parameters and outputs; the engine core and its step loop."""
