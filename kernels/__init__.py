"""hicache.kernels"""
