"""The model runner: persistent input batch, forward, sampling."""
