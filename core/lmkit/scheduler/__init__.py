"""Scheduling: what runs in each engine step."""
