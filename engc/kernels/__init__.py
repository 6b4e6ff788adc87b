"""Op contracts: one folder per op. Each __init__.py holds the plain-torch reference (run on CPU and used
as the test oracle) and is free of triton; the folder's triton.py holds the GPU kernel for the compiler."""
