"""Rewrite ``src/fedskew/catalog/index.json``, what ``fedskew methods`` prints, after adding or changing a method
(``tests/test_cli_startup.py`` says when it is due)."""

from fedskew.method_index import INDEX, write_index

if __name__ == "__main__":
    write_index()
    print(f"wrote {INDEX}")
