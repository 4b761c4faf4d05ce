"""One call signature's compiled programs (``Program``) on one placement.

With the values that describe them. The lowest layer of flaxside after ``jaxprs``: it
imports no adapter, no stack and no mesh code (a placement over a mesh is handed in).
"""
