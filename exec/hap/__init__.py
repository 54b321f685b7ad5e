"""HAP: Hierarchical Adaptive Pooling for graph classification (Liu et al., IEEE TKDE 2021,
arXiv 2104.05960), its torch_geometric baselines and the TU dataset loader.

Modules: ``model`` (HAP itself, dense batched graphs), ``baselines`` (GCN + mean/max pooling,
TopKPooling, SAGPooling, DiffPool), ``data`` (TU datasets from a scratch copy).
"""
