import sys

def main(argv=None):
    print("dikkat")
    return 0
