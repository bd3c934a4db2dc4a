import os

# Triton kernels run on CPU tensors through the interpreter in CI. This is set for the test
# process only (the library never reads environment variables to choose behaviour).
os.environ.setdefault("TRITON_INTERPRET", "1")
