"""The prefix index of the native engine: longest offered prefix, checked token by token."""

from caspo.rollout.native.prefix import PrefixIndex, SharedPrefix

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_longest_offered_prefix_wins():
    index = PrefixIndex(block=4)
    index.add(0, PROMPT)
    index.add(1, PROMPT[:6])
    assert index.lookup(PROMPT) == SharedPrefix(0, 9, exact=True)
    assert index.lookup(PROMPT[:6]) == SharedPrefix(1, 6, exact=True)
    assert index.lookup(PROMPT[:7] + [0, 0]) == SharedPrefix(1, 6, exact=False)  # a whole shorter prompt
    assert index.lookup(PROMPT[:8] + [0]) == SharedPrefix(0, 8, exact=False)  # a block prefix
    assert index.lookup(PROMPT[:8]) == SharedPrefix(1, 6, exact=False)  # the last token is always computed
    assert index.lookup([0] + PROMPT) is None


def test_first_holder_keeps_an_entry_until_it_leaves():
    index = PrefixIndex(block=4)
    index.add(0, PROMPT)
    index.add(1, PROMPT)
    assert index.lookup(PROMPT).slot == 0
    index.remove(0)
    assert index.lookup(PROMPT) is None  # slot 1 offered nothing new
    index.add(2, PROMPT)
    assert index.lookup(PROMPT).slot == 2
    assert index.whole_lengths == {9: 1}


def test_hits_are_checked_token_by_token():
    class Colliding(PrefixIndex):  # every prefix of a given length hashes alike
        def _block_hashes(self, tokens):
            return [0] * (len(tokens) // self.block)

        def _key(self, tokens, block_hashes, length):
            return length, 0

    index = Colliding(block=4)
    index.add(0, PROMPT)
    assert index.lookup(PROMPT) == SharedPrefix(0, 9, exact=True)
    assert index.lookup(PROMPT[:4] + [0] * 5) == SharedPrefix(0, 4, exact=False)
    assert index.lookup([9] * 9) is None
