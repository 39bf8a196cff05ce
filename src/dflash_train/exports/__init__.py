"""What goes with an exported drafter: its model card (card.py) and how each architecture's export is served
(serving.py: the serve tables of the docs and the card's serve lines)."""
