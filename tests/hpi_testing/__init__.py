"""Helpers shared by the test suite (on sys.path through pytest.ini's `pythonpath = tests`)."""
