"""Copy paths between device KV pools and pinned host pools (imports torch and triton only).

Entry points live in ``hicache.kernels.dispatch``: ``copy_rows`` (whole page/state rows of every
layer: staged gather + DMA when host rows come in runs, else the zero-copy Triton kernel) and
``copy_tokens`` (token-granular copies of a ``TokenFormat``). ``reference`` is the torch
implementation (CPU path and test oracle); ``tables`` holds ``LayerTable``, ``TokenFormat`` and
``TransferError``. Nothing is imported here, so importing the package stays cheap.
"""
