"""What the command line calls, one module per command: ``bench`` (and its timed steps),
``report``, ``recipes``, ``demo``, ``evaluate`` (``kd eval``), ``export``, and the tables they
print (``table``). ``kd train`` itself is :func:`kd.run.launch.train`.

May import anything in kd; nothing in kd imports it but ``cli.py`` and ``kd.commands`` itself.
"""
