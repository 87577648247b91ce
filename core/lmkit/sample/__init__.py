"""lmkit.sample"""
