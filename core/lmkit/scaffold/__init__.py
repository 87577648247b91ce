"""Plugin package scaffolds: ``lmkit plugin new NAME --kind KIND`` (see
:func:`lmkit.scaffold.generate.new_plugin`)."""
