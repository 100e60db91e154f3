"""vivant: real-time conversational video characters.

The distribution's top-level package. Its subpackages map to the repository's top-level folders
(`vivant.worker` ↔ worker/, `vivant.kernels` ↔ kernels/, `vivant.operator` ↔ operator/,
`vivant.sessions` ↔ sessions/, `vivant.bench` ↔ bench/); this folder holds only the command line.
"""

__version__ = "0.1.0"
