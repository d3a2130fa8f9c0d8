"""The package version, in a leaf module (bundles record it; nothing imports the package root for it)."""

__version__ = "0.1.0"
