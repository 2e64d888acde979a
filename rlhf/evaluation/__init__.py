"""What only eval.py reads: the policies it compares, its pairwise judges and its reports."""
