"""hicache.controllers"""
