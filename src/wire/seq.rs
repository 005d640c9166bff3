//! Per-stream sequence tracking, shared by every reader of a numbered stream.

/// The largest sequence jump counted as a gap: a stream whose sequence jumps further
/// forward (2^32 messages) was restarted or is confused, and the jump counts as a
/// reset rather than billions of lost messages.
pub(crate) const MAX_SEQUENCE_GAP: u64 = 1 << 32;

/// Per-publisher sequence tracking: a jump forward is a gap; a restart at 0 on a new
/// connection, a regression, or a jump of more than [`MAX_SEQUENCE_GAP`] is a reset.
#[derive(Debug, Default)]
pub(crate) struct SeqTracker {
    last: Option<u64>,
    fresh_connection: bool,
    /// The publisher id the numbers came from, for layouts that carry one.
    publisher: Option<u64>,
}

/// What one sequence number says about the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqStep {
    /// The expected next number (or the first one seen).
    InOrder,
    /// A jump forward over this many missing messages.
    Gap(u64),
    /// The publisher restarted its numbering (or sent nonsense).
    Reset,
}

impl SeqTracker {
    /// Whether it saw any number.
    pub(crate) fn has_seen(&self) -> bool {
        self.last.is_some()
    }

    pub(crate) fn new_connection(&mut self) {
        self.fresh_connection = true;
    }

    /// Classifies `seq` from `publisher` (when the layout carries an id): numbers from
    /// another publisher than before (one restarted behind the same endpoint) start a
    /// new stream, a reset.
    pub(crate) fn observe_from(&mut self, publisher: Option<u64>, seq: u64) -> SeqStep {
        if let Some(id) = publisher {
            if self.publisher.replace(id).is_some_and(|old| old != id) {
                self.last = None;
                self.observe(seq);
                return SeqStep::Reset;
            }
        }
        self.observe(seq)
    }

    /// Classifies `seq` against the previous one.
    pub(crate) fn observe(&mut self, seq: u64) -> SeqStep {
        let fresh = std::mem::take(&mut self.fresh_connection);
        let step = match self.last {
            None => SeqStep::InOrder,
            Some(_) if fresh && seq == 0 => SeqStep::Reset,
            Some(last) if seq > last => match seq - last - 1 {
                0 => SeqStep::InOrder,
                missing if missing > MAX_SEQUENCE_GAP => SeqStep::Reset,
                missing => SeqStep::Gap(missing),
            },
            // A regression (a publisher restarted without our noticing).
            Some(_) => SeqStep::Reset,
        };
        self.last = Some(seq);
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_and_resets() {
        let mut s = SeqTracker::default();
        s.new_connection();
        assert_eq!(s.observe(0), SeqStep::InOrder);
        assert_eq!(s.observe(1), SeqStep::InOrder);
        assert_eq!(s.observe(5), SeqStep::Gap(3));
        // Reconnect, publisher restarted: 0 is a reset.
        s.new_connection();
        assert_eq!(s.observe(0), SeqStep::Reset);
        // Reconnect, publisher kept going while we were away: a gap.
        s.new_connection();
        assert_eq!(s.observe(10), SeqStep::Gap(9));
        // A regression is a reset.
        assert_eq!(s.observe(3), SeqStep::Reset);
        // First message ever, not at 0: nothing to compare with.
        let mut t = SeqTracker::default();
        t.new_connection();
        assert_eq!(t.observe(42), SeqStep::InOrder);
    }

    #[test]
    fn another_publisher_behind_the_endpoint_is_a_reset_not_a_gap() {
        let mut s = SeqTracker::default();
        assert_eq!(s.observe_from(Some(1), 0), SeqStep::InOrder);
        assert_eq!(s.observe_from(Some(1), 1), SeqStep::InOrder);
        // Restarted as publisher 2, already at 50 when we reconnect.
        s.new_connection();
        assert_eq!(s.observe_from(Some(2), 50), SeqStep::Reset);
        assert_eq!(s.observe_from(Some(2), 51), SeqStep::InOrder);
        assert_eq!(s.observe_from(Some(2), 53), SeqStep::Gap(1));
        assert_eq!(s.observe_from(None, 54), SeqStep::InOrder);
    }

    #[test]
    fn an_absurd_jump_is_a_reset_not_a_gap() {
        let mut s = SeqTracker::default();
        assert_eq!(s.observe(0), SeqStep::InOrder);
        assert_eq!(s.observe(u64::MAX), SeqStep::Reset);
        assert_eq!(s.observe(0), SeqStep::Reset);
        assert_eq!(
            s.observe(MAX_SEQUENCE_GAP + 1),
            SeqStep::Gap(MAX_SEQUENCE_GAP)
        );
        assert_eq!(s.observe(2 * MAX_SEQUENCE_GAP + 3), SeqStep::Reset);
    }
}
