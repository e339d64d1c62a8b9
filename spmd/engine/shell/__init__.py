"""A rank's shell, the parts its kernel (engine/rank_kernel.py) runs a cell with: its output
streams (streams.py), the messages no one reads left unsent (quiet.py), ``!cmd`` without fork
(commands.py), completion (introspect.py), ``input()``, getpass and pdb answered in the notebook
(prompts.py), JupyterLab's debugger (debugging.py), and widgets' text (widget_text.py)."""
