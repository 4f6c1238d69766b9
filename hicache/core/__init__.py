"""Leaf layer of hicache: layout model, wire protocol and its command table, errors, sizes,
configuration types, the capacity planner and the IPC helpers both sides share.

Nothing here imports another hicache package (a test walks every import). Importing this
package imports nothing.
"""
