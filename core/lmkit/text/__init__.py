"""lmkit.text"""
