"""The Python models of the repository. Each rendered `<model>/1/model.py` only imports its TritonPythonModel from
here, so the code runs from the installed v4engine, at the same version as the runtime it drives.

These modules import `triton_python_backend_utils`, which exists only inside Triton's Python-backend stub.
"""
