"""The one compiled part of rollfeed: the window read's kernel (rollfeed/payload/read/_window.c).

``optional``: where it cannot be built (no C compiler), the install goes on and every read takes
the planned NumPy reader (rollfeed.payload.read.compiled_read.COMPILED is False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rollfeed.payload.read._window",
            ["rollfeed/payload/read/_window.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
