"""The SPMD Jupyter kernel: "Python 3 (SPMD, N processes)" in JupyterLab's launcher.

``python -m spmd.kernel install | list | remove`` manages its kernelspecs
(``spmd.kernel.kernelspec``); Jupyter launches it as ``python -m spmd.kernel.app``.
"""
