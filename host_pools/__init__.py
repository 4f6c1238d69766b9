"""hicache.host_pools"""
