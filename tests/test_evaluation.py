"""The embedded model's quality measures: header extraction, the blank-line cut, and the parse check."""
import pytest

from pocketjax.training.evaluation import cut_at_blank_line, function_headers, parses

SOURCE = '''
import os


def top(a, b=1):
    return a + b


class K:
    def method(self, x):
        """Doc."""
        return x

    @property
    def decorated(self):
        return 1

    def multi(self,
              y):
        return y
'''


def test_function_headers_are_one_line_dedented_and_spread():
    assert function_headers([SOURCE], n=2) == ["def top(a, b=1):\n", "def method(self, x):\n"]
    with pytest.raises(ValueError, match="only 2 function headers"):
        function_headers([SOURCE, "def broken(:\n"], n=3)


def test_cut_at_blank_line_and_parse():
    completion = "    return n\n    \nprint(fib(3))\n"
    assert cut_at_blank_line(completion) == "    return n\n"
    assert parses("def fib(n):\n" + cut_at_blank_line(completion))
    assert not parses("def fib(n):\n    return (n\n")
    assert not parses("def fib(n):\n")  # a header alone is not a function
    assert cut_at_blank_line("    x = 1") == "    x = 1"
