"""lmkit.loading"""
