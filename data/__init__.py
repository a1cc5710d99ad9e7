"""The data the notebooks read, shipped inside the wheel as ``flashlib.data_files`` (``pyproject.toml`` maps
this folder there): a pip-installed flashlib finds it through :func:`flashlib.data.data_dir`, as a clone does.
Nothing here is code to import; the ``make_*.py`` scripts that made the files stay out of the wheel."""
