#!/usr/bin/env python3
"""Check that edits to C/C++/CUDA files changed comments only.

  python3 dev/check_comment_only.py [--base REV] FILE...

For each FILE, compares the working-tree text with its text at REV (default HEAD): comments (// and /* */,
outside string and character literals) are removed, each line's whitespace runs collapse to one space, and
blank lines are dropped; the remaining code lines must be identical, in order. Exits 1 on any difference.
"""
import subprocess, sys


def strip_comments(src):
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c == '/' and i + 1 < n and src[i + 1] == '/':
            j = src.find('\n', i)
            if j < 0:
                break
            # a // comment ending in a backslash continues onto the next line: refuse to guess
            if src[i:j].rstrip().endswith('\\'):
                raise SystemExit('line comment ending in a backslash at offset %d' % i)
            i = j
        elif c == '/' and i + 1 < n and src[i + 1] == '*':
            j = src.find('*/', i + 2)
            if j < 0:
                raise SystemExit('unterminated /* comment')
            out.append(' ' + '\n' * src.count('\n', i, j))
            i = j + 2
        elif c == 'R' and src.startswith('R"', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == '_')):
            k = src.find('(', i)
            delim = src[i + 2:k]
            j = src.find(')' + delim + '"', k)
            out.append(src[i:j + len(delim) + 2]); i = j + len(delim) + 2
        elif c in '"\'':
            # a ' between digits is a C++14 digit separator, not a character literal
            if c == "'" and i > 0 and src[i - 1].isalnum() and i + 1 < n and src[i + 1].isalnum() and \
                    not (src[i - 1] in 'uUL8' and (i < 2 or not src[i - 2].isalnum())):
                out.append(c); i += 1; continue
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == '\\' else 1
            out.append(src[i:j + 1]); i = j + 1
        else:
            out.append(c); i += 1
    return ''.join(out)


def code_lines(src):
    lines = []
    for line in strip_comments(src).split('\n'):
        t = ' '.join(line.split())
        if t:
            lines.append(t)
    return lines


def main():
    args, base = sys.argv[1:], 'HEAD'
    if args[:1] == ['--base']:
        base, args = args[1], args[2:]
    bad = 0
    for f in args:
        old = subprocess.run(['git', 'show', '%s:%s' % (base, f)], capture_output=True, text=True, check=True).stdout
        new = open(f).read()
        a, b = code_lines(old), code_lines(new)
        if a != b:
            bad += 1
            for k, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    print('%s: code line %d differs:\n  was: %s\n  now: %s' % (f, k + 1, x, y)); break
            else:
                print('%s: %d code lines were, %d now' % (f, len(a), len(b)))
        else:
            print('%s: code unchanged (%d code lines; %d -> %d lines)' % (f, len(a), old.count('\n'), new.count('\n')))
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
