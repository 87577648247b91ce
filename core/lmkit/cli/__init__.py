"""lmkit.cli"""
