"""llama-cpp-python, imported only after the worker has settled which C++ runtime llama.cpp's
libraries use (worker/backends/cxx_runtime.py): its import loads them. The llama.cpp modules of
the worker take `ll`, `llc` and `mt` from here, never from llama_cpp directly."""

from worker.backends import cxx_runtime

RUNTIME = cxx_runtime.settle()

import llama_cpp as ll  # noqa: E402  (after settle(): this import loads the libraries)
import llama_cpp.llama_cpp as llc  # noqa: E402
import llama_cpp.mtmd_cpp as mt  # noqa: E402

__all__ = ["RUNTIME", "ll", "llc", "mt"]
