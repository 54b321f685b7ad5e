"""ADMMiRNN: ADMM training of an unfolded vanilla RNN, serial, SP and AP (Tang et al., arXiv 2006.05622).

``rnn_admm`` holds the algorithm, ``baselines`` the same RNN under SGD/Adam, ``parallel`` the
torch.distributed variants and ``data`` the digits / Tiny Shakespeare loaders. Submodules are not
imported here, so ``import exec.admm`` stays cheap.
"""
