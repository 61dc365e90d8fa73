"""The documentation site's tooling: MkDocs hooks (hooks.py), the griffe extension that reads torch-style docstrings
(torch_docstrings.py), the design page's diagrams (diagrams.py) and the headless-browser check of the built site
(browser_check.py). ``make docs`` builds the site, ``make docs-check`` opens it in a browser; mkdocs.yml says how."""
