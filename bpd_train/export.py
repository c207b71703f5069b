"""`from bpd_train.export import load_bundle`, as the model cards of bundles exported before the package's folders
followed its layers say: a thin module that re-exports the names users import. Export itself is
bpd_train/app/export.py (run as `python export.py`)."""

from bpd_train.app.export import BundleError, export_bundle, load_bundle

__all__ = ["BundleError", "export_bundle", "load_bundle"]
