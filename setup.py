"""Build of the native UCX binding (everything else is configured in pyproject.toml).

The extension ``astate_store._ucx`` compiles against the headers and libraries that
the ``libucx`` wheel (``libucx-cu12``) installs. At run time
``astate_store.transport.ucx`` calls ``libucx.load_library()`` before importing it, so
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` lets a system UCX take over; the rpath
below is only the fallback.
"""

import os

from setuptools import Extension, setup


def _libucx_dirs():
    try:
        import libucx
    except ImportError as exc:  # pragma: no cover - build-time guard
        raise SystemExit("building astate_store._ucx needs the libucx-cu12 package installed") from exc
    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


_inc, _lib = _libucx_dirs()

setup(
    ext_modules=[
        Extension(
            "astate_store._ucx",
            sources=["native/astate_ucx.c"],
            include_dirs=[_inc],
            library_dirs=[_lib],
            libraries=["ucp", "ucs"],
            runtime_library_dirs=[_lib],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
        ),
        # Change maps of delta versions (docs/delta.md): no UCX; XXH3 comes from the xxhash
        # package's extension at run time (dlopen), so nothing but libc is linked.
        Extension(
            "astate_store._delta",
            sources=["native/astate_delta.c"],
            libraries=["dl"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
        ),
    ]
)
