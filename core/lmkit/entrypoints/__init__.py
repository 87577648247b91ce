"""User entry points: the offline LLM class."""
