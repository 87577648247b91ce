"""lmkit.kv_cache"""
