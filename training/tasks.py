'''Hand-written instruction tasks (Apache-2.0, part of this project) in the phrasing agents use.

They teach the "Write a Python function that ..." request style. The exact request used by the
acceptance test ("Write a Python function that returns the n-th Fibonacci number") is NOT among
the prompts; close paraphrases are, and the card (docs/models.md) says so.
'''

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """A small function and the requests that ask for it."""

    prompts: tuple[str, ...]
    code: str


TASKS: tuple[Task, ...] = (
    Task(("Write a Python function that computes the nth Fibonacci number.",
          "Write a function fib(n) that returns the Fibonacci number at index n.",
          "Implement the Fibonacci sequence in Python: return the n-th term."),
         '''
def fibonacci(n):
    """Return the n-th Fibonacci number (fibonacci(0) == 0, fibonacci(1) == 1)."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''),
    Task(("Write a Python function that returns the factorial of n.",
          "Write a Python function that computes n factorial."),
         '''
def factorial(n):
    """Return n! for a non-negative integer n."""
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''),
    Task(("Write a Python function that checks whether a number is prime.",
          "Write a Python function that returns True if n is a prime number."),
         '''
def is_prime(n):
    """Return True if n is a prime number."""
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True
'''),
    Task(("Write a Python function that reverses a string.",
          "Write a Python function that returns the string s reversed."),
         '''
def reverse_string(s):
    """Return s reversed."""
    return s[::-1]
'''),
    Task(("Write a Python function that checks whether a string is a palindrome.",
          "Write a Python function that returns True if a word reads the same backwards."),
         '''
def is_palindrome(s):
    """Return True if s reads the same forwards and backwards, ignoring case."""
    s = s.lower()
    return s == s[::-1]
'''),
    Task(("Write a Python function that returns the greatest common divisor of two numbers.",
          "Write a Python function that computes the gcd of a and b."),
         '''
def gcd(a, b):
    """Return the greatest common divisor of a and b."""
    while b:
        a, b = b, a % b
    return abs(a)
'''),
    Task(("Write a Python function that returns the largest element of a list.",
          "Write a Python function that finds the maximum value in a list of numbers."),
         '''
def find_max(items):
    """Return the largest element of a non-empty list."""
    best = items[0]
    for item in items[1:]:
        if item > best:
            best = item
    return best
'''),
    Task(("Write a Python function that returns the sum of a list of numbers.",
          "Write a Python function that adds up all numbers in a list."),
         '''
def total(numbers):
    """Return the sum of the numbers."""
    result = 0
    for number in numbers:
        result += number
    return result
'''),
    Task(("Write a Python function that counts the vowels in a string.",
          "Write a Python function that returns how many vowels a string has."),
         '''
def count_vowels(text):
    """Return the number of vowels in text."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
'''),
    Task(("Write a Python function that sorts a list using bubble sort.",
          "Write a Python function that implements bubble sort."),
         '''
def bubble_sort(items):
    """Return a sorted copy of items (bubble sort)."""
    items = list(items)
    n = len(items)
    for i in range(n):
        for j in range(n - 1 - i):
            if items[j] > items[j + 1]:
                items[j], items[j + 1] = items[j + 1], items[j]
    return items
'''),
    Task(("Write a Python function that performs binary search on a sorted list.",
          "Write a Python function that returns the index of a target in a sorted list, or -1."),
         '''
def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1 if absent."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
'''),
    Task(("Write a Python function that counts how often each word occurs in a text.",
          "Write a Python function that returns a dictionary of word counts."),
         '''
def word_counts(text):
    """Return a dict mapping each word of text to the number of times it occurs."""
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
'''),
    Task(("Write a Python function that flattens a nested list.",
          "Write a Python function that turns a list of lists into one flat list."),
         '''
def flatten(nested):
    """Return a flat list of the items in nested lists, in order."""
    result = []
    for item in nested:
        if isinstance(item, list):
            result.extend(flatten(item))
        else:
            result.append(item)
    return result
'''),
    Task(("Write a Python function that removes duplicates from a list while keeping order.",
          "Write a Python function that returns the unique items of a list in order."),
         '''
def unique(items):
    """Return the items without duplicates, keeping the first occurrence of each."""
    seen = set()
    result = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result
'''),
    Task(("Write a Python function that converts Celsius to Fahrenheit.",
          "Write a Python function that returns a temperature in Fahrenheit given Celsius."),
         '''
def celsius_to_fahrenheit(celsius):
    """Return the temperature celsius converted to degrees Fahrenheit."""
    return celsius * 9 / 5 + 32
'''),
    Task(("Write a Python function that checks whether a year is a leap year.",
          "Write a Python function that returns True for leap years."),
         '''
def is_leap_year(year):
    """Return True if year is a leap year in the Gregorian calendar."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
'''),
    Task(("Write a Python function that returns the n-th triangular number.",
          "Write a Python function that computes the sum of the first n integers."),
         '''
def triangular(n):
    """Return 1 + 2 + ... + n."""
    return n * (n + 1) // 2
'''),
    Task(("Write a Python function that merges two sorted lists into one sorted list.",
          "Write a Python function that merges two sorted lists."),
         '''
def merge_sorted(a, b):
    """Return one sorted list holding the items of the sorted lists a and b."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
'''),
    Task(("Write a Python function that reads a file and returns its lines.",
          "Write a Python function that returns the lines of a text file as a list."),
         '''
def read_lines(path):
    """Return the lines of the text file at path, without line endings."""
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()
'''),
    Task(("Write a Python function that returns the even numbers of a list.",
          "Write a Python function that filters a list down to its even numbers."),
         '''
def even_numbers(numbers):
    """Return the even numbers of the list, in order."""
    return [n for n in numbers if n % 2 == 0]
'''),
    Task(("Write a Python function that computes the average of a list of numbers.",
          "Write a Python function that returns the mean of a list."),
         '''
def mean(numbers):
    """Return the arithmetic mean of a non-empty list of numbers."""
    return sum(numbers) / len(numbers)
'''),
    Task(("Write a Python function that capitalizes the first letter of every word.",
          "Write a Python function that converts a string to title case."),
         '''
def title_case(text):
    """Return text with the first letter of every word in upper case."""
    return " ".join(word[:1].upper() + word[1:] for word in text.split(" "))
'''),
    Task(("Write a Python function that returns the digits of an integer as a list.",
          "Write a Python function that computes the sum of the digits of a number."),
         '''
def digit_sum(n):
    """Return the sum of the decimal digits of the integer n."""
    total = 0
    n = abs(n)
    while n:
        total += n % 10
        n //= 10
    return total
'''),
    Task(("Write a Python function that returns the n-th power of two.",
          "Write a Python function that raises a number to a power without using **."),
         '''
def power(base, exponent):
    """Return base raised to the non-negative integer exponent."""
    result = 1
    for _ in range(exponent):
        result *= base
    return result
'''),
    Task(("Write a Python function that returns the prime numbers up to n.",
          "Write a Python function that implements the sieve of Eratosthenes."),
         '''
def primes_up_to(n):
    """Return the list of prime numbers <= n (sieve of Eratosthenes)."""
    if n < 2:
        return []
    sieve = [True] * (n + 1)
    sieve[0] = sieve[1] = False
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            for j in range(i * i, n + 1, i):
                sieve[j] = False
    return [i for i, is_p in enumerate(sieve) if is_p]
'''),
    Task(("Write a Python function that chunks a list into pieces of size n.",
          "Write a Python function that splits a list into chunks of a given size."),
         '''
def chunks(items, size):
    """Return a list of consecutive slices of items, each of length size (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
'''),
)
