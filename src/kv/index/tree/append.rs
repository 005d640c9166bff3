//! Growing a fresh run in place: the fast path of a chain stored past everything the
//! tree holds (a dump, a long prompt), one position at a time without looking up
//! edges.

use super::{MAX_RUN, Tree};
use crate::kv::event::TokensHash;

impl Tree {
    /// A new position right after `p` with `tokens`, held by `slot` alone, when `p`
    /// ends a run only `slot` holds, with nothing below it and room for one more
    /// position; `None` otherwise (nothing changed: the caller goes the general way).
    /// `more` is how many positions the caller may append after this one: the run's
    /// lists grow once for them instead of doubling.
    pub(in crate::kv::index) fn append(
        &mut self,
        p: u32,
        tokens: TokensHash,
        slot: u32,
        more: usize,
    ) -> Option<u32> {
        let (n, off) = self.loc(p)?;
        let node = self.node(n)?;
        let len = node.tokens.len();
        let appendable = off + 1 == len
            && node.children == 0
            && node.holders.as_slice() == [slot]
            && len < MAX_RUN;
        if !appendable {
            return None;
        }
        let q = self.alloc_loc();
        let offset = self.with_node(n, |node| {
            if node.tokens.len() == node.tokens.capacity() {
                let grow = more.saturating_add(1).min(MAX_RUN - len);
                node.tokens.reserve_exact(grow);
                node.pos.reserve_exact(grow);
            }
            node.tokens.push(tokens);
            node.pos.push(q);
            node.tokens.len() - 1
        })?;
        self.set_loc(q, n, offset);
        self.positions += 1;
        Some(q)
    }
}
