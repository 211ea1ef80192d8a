from kv_transfer.attempts import Attempts


class Peer:
    def notify(self, request_id, outcome):
        pass


def test_join_drop_and_rejoin():
    attempts = Attempts()
    a, b = Peer(), Peer()
    attempts.start(b"one")
    attempts.join(a)
    attempts.join(a)  # once only
    attempts.join(b)
    assert attempts.peers == [a, b] and attempts.carries(a) and not attempts.dropped(a)
    assert attempts.drop() == [a, b]
    assert (attempts.epoch, attempts.retired, attempts.peers) == (1, {b"one"}, [])
    assert attempts.dropped(a) and not attempts.carries(a)
    assert attempts.is_retired(b"one") and not attempts.is_retired(b"two")
    attempts.start(b"two")
    attempts.join(a)  # a persistent connection carries the next attempt
    assert attempts.carries(a) and not attempts.dropped(a) and attempts.stale_peers == [b]
    assert attempts.current == b"two"
