//! The prefix tree under [`RouterIndex`](super::RouterIndex): every distinct block
//! place (a *position*: a tokens hash under its parent position) lives in a *run*, a
//! node holding consecutive positions of one path that the same ranks hold. A walk
//! compares a run's tokens hashes as one slice and looks at its holders once, so a
//! query costs one table probe per run, not per block.
//!
//! Positions have stable ids (what a rank's table maps its block hashes to); a run is
//! split where a rank starts or stops holding part of it, and merged back into its
//! only child when both have the same holders. A run holds at most [`MAX_RUN`]
//! positions, so a split or a merge costs at most that many moves, whatever an event
//! asks for.

use std::mem::size_of;

use smallvec::SmallVec;

use crate::hash::FastMap;
use crate::kv::event::TokensHash;

mod append;

/// The root node: no position of its own; the first blocks of every path hang
/// under it.
pub(super) const ROOT: u32 = 0;

/// Positions one run holds at most: the cost bound of a split or a merge (each
/// moves at most this many positions).
pub(super) const MAX_RUN: usize = 128;

/// Slots (positions or runs) below which the tables are never compacted.
const COMPACT_FROM: usize = 1 << 16;

/// `Node::child` when the node's only child is not known.
const NO_CHILD: u32 = u32::MAX;

/// One run: consecutive positions of a path, held by the same ranks.
#[derive(Debug)]
pub(super) struct Node {
    parent: u32,
    /// The positions' tokens hashes, in path order (empty for the root and for a
    /// freed slot).
    pub(super) tokens: Vec<TokensHash>,
    /// The positions' ids, parallel to `tokens`.
    pub(super) pos: Vec<u32>,
    /// Child runs (edges keyed by their first tokens hash).
    children: u32,
    /// The only child, when `children == 1` and it is known (else `NO_CHILD`).
    child: u32,
    /// Rank slots holding every position of the run, sorted.
    pub(super) holders: SmallVec<[u32; 2]>,
}

impl Node {
    fn new(
        parent: u32,
        tokens: Vec<TokensHash>,
        pos: Vec<u32>,
        holders: SmallVec<[u32; 2]>,
    ) -> Node {
        Node {
            parent,
            tokens,
            pos,
            children: 0,
            child: NO_CHILD,
            holders,
        }
    }

    /// Child runs it has.
    pub(super) fn children(&self) -> u32 {
        self.children
    }

    /// Heap bytes the node owns.
    fn heap(&self) -> usize {
        let holders = if self.holders.spilled() {
            self.holders.capacity() * size_of::<u32>()
        } else {
            0
        };
        self.tokens.capacity() * size_of::<TokensHash>()
            + self.pos.capacity() * size_of::<u32>()
            + holders
    }
}

/// Where a position is: its run and its offset in it.
#[derive(Debug, Clone, Copy, Default)]
struct Loc {
    node: u32,
    offset: u32,
}

/// Bytes a hash table of `capacity` entries of `entry` bytes takes (its control
/// bytes and a load factor of 7/8 included).
pub(super) fn table_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = (capacity.saturating_mul(8) / 7).next_power_of_two();
    buckets.saturating_mul(entry + 1)
}

const EDGE_ENTRY: usize = size_of::<((u32, TokensHash), u32)>();

/// Bytes a store may add besides its positions: two splits (two runs copied out,
/// their slots, their edges).
const SPLIT_SLACK: usize =
    2 * (MAX_RUN * (size_of::<TokensHash>() + size_of::<u32>()) + size_of::<Node>() + EDGE_ENTRY);

/// Bytes one more position may add at most (its location, its run slots with a
/// doubling's spare room).
pub(super) const POSITION_BYTES: usize =
    size_of::<Loc>() + 2 * (size_of::<TokensHash>() + size_of::<u32>());

/// The tree: runs, the edges between them, and where each position is.
#[derive(Debug)]
pub(super) struct Tree {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// (parent run, first tokens hash of the child run) → child run.
    edges: FastMap<(u32, TokensHash), u32>,
    /// The largest capacity `edges` has had since it was made or last shrunk.
    edges_cap_seen: usize,
    locs: Vec<Loc>,
    free_locs: Vec<u32>,
    positions: usize,
    /// Heap bytes the nodes own (their runs and spilled holder lists).
    heap_bytes: usize,
}

impl Tree {
    pub(super) fn new() -> Tree {
        Tree {
            nodes: vec![Node::new(ROOT, Vec::new(), Vec::new(), SmallVec::new())],
            free_nodes: Vec::new(),
            edges: FastMap::default(),
            edges_cap_seen: 0,
            locs: Vec::new(),
            free_locs: Vec::new(),
            positions: 0,
            heap_bytes: 0,
        }
    }

    /// Positions in the tree.
    pub(super) fn positions(&self) -> usize {
        self.positions
    }

    /// Bytes the tree's tables take, spare capacity included.
    pub(super) fn bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.free_nodes.capacity() * size_of::<u32>()
            + table_bytes(self.edges_cap_seen, EDGE_ENTRY)
            + self.locs.capacity() * size_of::<Loc>()
            + self.free_locs.capacity() * size_of::<u32>()
            + self.heap_bytes
    }

    /// Bytes `positions` more positions may add at most, besides
    /// [`POSITION_BYTES`] each: the tables that would grow, and two splits.
    pub(super) fn growth(&self, positions: usize) -> usize {
        let vec = |len: usize, cap: usize, free: usize, add: usize, entry: usize| {
            if free < add && len + add > cap {
                (cap * 2).max(len + add).saturating_mul(entry)
            } else {
                0
            }
        };
        let edges = if self.edges.len() + 2 > self.edges.capacity() {
            table_bytes(
                (self.edges.capacity() * 2).max(self.edges.len() + 2),
                EDGE_ENTRY,
            )
        } else {
            0
        };
        vec(
            self.locs.len(),
            self.locs.capacity(),
            self.free_locs.len(),
            positions,
            size_of::<Loc>(),
        ) + vec(
            self.nodes.len(),
            self.nodes.capacity(),
            self.free_nodes.len(),
            2,
            size_of::<Node>(),
        ) + edges
            + SPLIT_SLACK
    }

    pub(super) fn node(&self, n: u32) -> Option<&Node> {
        self.nodes.get(n as usize)
    }

    /// The child run of `at` starting with `tokens`.
    pub(super) fn child(&self, at: u32, tokens: TokensHash) -> Option<u32> {
        self.edges.get(&(at, tokens)).copied()
    }

    fn loc(&self, p: u32) -> Option<(u32, usize)> {
        self.locs
            .get(p as usize)
            .map(|l| (l.node, l.offset as usize))
    }

    /// Whether rank `slot` holds position `p`.
    pub(super) fn holds(&self, slot: u32, p: u32) -> bool {
        self.loc(p)
            .and_then(|(n, _)| self.node(n))
            .is_some_and(|n| n.holders.binary_search(&slot).is_ok())
    }

    /// The run position `p` is in, from `p` on: its tokens hashes and ids.
    pub(super) fn run_from(&self, p: u32) -> Option<(&[TokensHash], &[u32])> {
        let (n, off) = self.loc(p)?;
        let node = self.node(n)?;
        Some((node.tokens.get(off..)?, node.pos.get(off..)?))
    }

    /// The position after `cursor` (`None`: the root) with `tokens`, if there is one.
    pub(super) fn next(&self, cursor: Option<u32>, tokens: TokensHash) -> Option<u32> {
        let at = match cursor {
            None => ROOT,
            Some(c) => {
                let (n, off) = self.loc(c)?;
                let node = self.node(n)?;
                if off + 1 < node.tokens.len() {
                    return (node.tokens.get(off + 1) == Some(&tokens))
                        .then(|| node.pos.get(off + 1).copied())
                        .flatten();
                }
                if node.children == 0 {
                    return None;
                }
                n
            }
        };
        self.node(self.child(at, tokens)?)?.pos.first().copied()
    }

    /// A new position after `cursor` (`None`: the root) with `tokens`, held by
    /// `slot` alone. There must be no such position yet.
    pub(super) fn new_position(
        &mut self,
        cursor: Option<u32>,
        tokens: TokensHash,
        slot: u32,
    ) -> Option<u32> {
        let parent = match cursor {
            None => ROOT,
            Some(c) => {
                let (n, off) = self.loc(c)?;
                if off + 1 < self.node(n)?.tokens.len() {
                    self.split_before(n, off + 1)?
                } else {
                    n
                }
            }
        };
        let p = self.alloc_loc();
        let node = self.node(parent)?;
        let append = parent != ROOT
            && node.children == 0
            && node.holders.as_slice() == [slot]
            && node.tokens.len() < MAX_RUN;
        if append {
            let offset = self.with_node(parent, |n| {
                n.tokens.push(tokens);
                n.pos.push(p);
                n.tokens.len() - 1
            })?;
            self.set_loc(p, parent, offset);
        } else {
            let holders = SmallVec::from_slice(&[slot]);
            let n = self.alloc_node(Node::new(parent, vec![tokens], vec![p], holders));
            self.insert_edge((parent, tokens), n);
            self.with_node(parent, |pn| {
                pn.children += 1;
                pn.child = if pn.children == 1 { n } else { NO_CHILD };
            });
            self.set_loc(p, n, 0);
        }
        self.positions += 1;
        Some(p)
    }

    /// Rank `slot` (holding none of them) takes position `p` and the `m - 1` after
    /// it in its run.
    pub(super) fn hold_run(&mut self, slot: u32, p: u32, m: usize) -> Option<()> {
        let n = self.isolate(p, m)?;
        self.with_node(n, |node| {
            if let Err(at) = node.holders.binary_search(&slot) {
                node.holders.insert(at, slot);
            }
        })?;
        self.settle(n);
        Some(())
    }

    /// Rank `slot` lets go of position `p` and the `m - 1` after it in its run (it
    /// holds them all).
    pub(super) fn release(&mut self, slot: u32, p: u32, m: usize) -> Option<()> {
        let (n, off) = self.loc(p)?;
        let node = self.node(n)?;
        let len = node.tokens.len();
        if node.children == 0 && node.holders.as_slice() == [slot] && off + m == len {
            // The tail of a run only this rank holds, with nothing below: it goes
            // (an engine evicting a sequence, tail first).
            if off == 0 {
                self.with_node(n, |node| node.holders.clear());
                self.free_up(n);
            } else {
                let gone = self.with_node(n, |node| {
                    node.tokens.truncate(off);
                    let gone = node.pos.split_off(off);
                    if node.tokens.capacity() > 2 * node.tokens.len() + 8 {
                        node.tokens.shrink_to_fit();
                        node.pos.shrink_to_fit();
                    }
                    gone
                })?;
                self.positions -= gone.len();
                self.free_locs.extend(gone);
            }
            return Some(());
        }
        let n = self.isolate(p, m)?;
        self.drop_holder(n, slot);
        Some(())
    }

    /// Where position `p` is: its run and its offset in it.
    pub(super) fn locate(&self, p: u32) -> Option<(u32, usize)> {
        self.loc(p)
    }

    /// Rank `slot` lets go of the whole run `p` is in (the rank is going: every
    /// run it holds is let go of this way).
    pub(super) fn release_run_of(&mut self, slot: u32, p: u32) {
        if let Some((n, _)) = self.loc(p) {
            self.drop_holder(n, slot);
        }
    }

    /// Takes `slot` off run `n`'s holders (nothing if it is not one), then frees or
    /// merges what that leaves.
    fn drop_holder(&mut self, n: u32, slot: u32) {
        let dropped = self.with_node(n, |node| match node.holders.binary_search(&slot) {
            Ok(at) => {
                node.holders.remove(at);
                if node.holders.spilled() && node.holders.len() <= node.holders.inline_size() {
                    node.holders.shrink_to_fit();
                }
                true
            }
            Err(_) => false,
        });
        if dropped == Some(true) {
            self.settle(n);
        }
    }

    /// After run `n`'s holders changed: frees it (and the ancestors that leaves
    /// empty) when nothing holds it or anything below it, else merges it with its
    /// only child and its parent where their holders are the same.
    fn settle(&mut self, n: u32) {
        let Some(node) = self.node(n) else {
            return;
        };
        if node.holders.is_empty() && node.children == 0 {
            self.free_up(n);
            return;
        }
        let n = match (node.children, node.child) {
            (1, c) if c != NO_CHILD => self.merge_parent(c).unwrap_or(n),
            _ => n,
        };
        self.merge_parent(n);
    }

    /// Makes positions `p..p + m` of `p`'s run a run of their own; returns it.
    fn isolate(&mut self, p: u32, m: usize) -> Option<u32> {
        let (mut n, off) = self.loc(p)?;
        if off > 0 {
            if self.can_split_after(n) {
                n = self.split_after(n, off)?;
            } else {
                self.split_before(n, off)?;
            }
        }
        if m >= self.node(n)?.tokens.len() {
            Some(n)
        } else if self.can_split_after(n) {
            self.split_after(n, m)?;
            Some(n)
        } else {
            self.split_before(n, m)
        }
    }

    /// Whether [`split_after`](Self::split_after) can hand run `n`'s children to
    /// the new run (none, or its one known child: one edge to move).
    fn can_split_after(&self, n: u32) -> bool {
        self.node(n).is_some_and(|node| {
            node.children == 0 || (node.children == 1 && node.child != NO_CHILD)
        })
    }

    /// Moves run `n`'s positions from `at` on (0 < `at` < its length) into a new
    /// run that becomes `n`'s only child, taking `n`'s child (see
    /// [`can_split_after`](Self::can_split_after)); returns it. Only the moved
    /// positions are touched.
    fn split_after(&mut self, n: u32, at: usize) -> Option<u32> {
        let (tokens, pos, holders, children, child) = self.with_node(n, |node| {
            if at == 0 || at >= node.tokens.len() {
                return None;
            }
            let tokens: Vec<TokensHash> = node.tokens.drain(at..).collect();
            let pos: Vec<u32> = node.pos.drain(at..).collect();
            if node.tokens.capacity() > 2 * node.tokens.len() + 8 {
                node.tokens.shrink_to_fit();
                node.pos.shrink_to_fit();
            }
            Some((tokens, pos, node.holders.clone(), node.children, node.child))
        })??;
        let first = *tokens.first()?;
        let mut suffix = Node::new(n, tokens, pos, holders);
        suffix.children = children;
        suffix.child = child;
        let s = self.alloc_node(suffix);
        self.with_node(n, |node| {
            node.children = 1;
            node.child = s;
        });
        if child != NO_CHILD {
            self.reparent(child, n, s);
        }
        self.insert_edge((n, first), s);
        self.relocate_from(s, 0);
        Some(s)
    }

    /// Moves run `child`'s edge from parent `from` to parent `to`.
    fn reparent(&mut self, child: u32, from: u32, to: u32) {
        let Some(first) = self.node(child).and_then(|c| c.tokens.first().copied()) else {
            return;
        };
        self.edges.remove(&(from, first));
        self.insert_edge((to, first), child);
        self.with_node(child, |c| c.parent = to);
    }

    /// Moves run `n`'s first `at` positions (0 < `at` < its length) into a new run
    /// that becomes `n`'s parent; returns it. `n` keeps its id and its children.
    fn split_before(&mut self, n: u32, at: usize) -> Option<u32> {
        let (parent, first, rest_first, tokens, pos, holders) = self.with_node(n, |node| {
            if at == 0 || at >= node.tokens.len() {
                return None;
            }
            let tokens: Vec<TokensHash> = node.tokens.drain(..at).collect();
            let pos: Vec<u32> = node.pos.drain(..at).collect();
            if node.tokens.capacity() > 2 * node.tokens.len() + 8 {
                node.tokens.shrink_to_fit();
                node.pos.shrink_to_fit();
            }
            Some((
                node.parent,
                *tokens.first()?,
                *node.tokens.first()?,
                tokens,
                pos,
                node.holders.clone(),
            ))
        })??;
        let mut prefix = Node::new(parent, tokens, pos, holders);
        prefix.children = 1;
        prefix.child = n;
        let p = self.alloc_node(prefix);
        self.with_node(n, |node| node.parent = p);
        self.with_node(parent, |pn| {
            if pn.child == n {
                pn.child = p;
            }
        });
        if let Some(e) = self.edges.get_mut(&(parent, first)) {
            *e = p;
        }
        self.insert_edge((p, rest_first), n);
        self.relocate_from(p, 0);
        self.relocate_from(n, 0);
        Some(p)
    }

    /// Merges run `c` with its parent when the parent is not the root, has `c` as
    /// its only child, the same holders, and the two fit in one run; returns the
    /// run they make. `c` is appended to its parent when `c`'s children can follow
    /// (none, or one known), so only `c`'s positions move; else the parent is put
    /// in front of `c`.
    fn merge_parent(&mut self, c: u32) -> Option<u32> {
        let node = self.node(c)?;
        let p = node.parent;
        let pn = self.node(p)?;
        if p == ROOT
            || pn.children != 1
            || pn.holders != node.holders
            || pn.tokens.len() + node.tokens.len() > MAX_RUN
        {
            return None;
        }
        let c_first = *node.tokens.first()?;
        let p_first = *pn.tokens.first()?;
        let grand = pn.parent;
        let p_len = pn.tokens.len();
        if self.can_split_after(c) {
            // Append `c` to its parent; `c`'s child, if any, moves up with it.
            let (tokens, pos, children, child) = self.with_node(c, |node| {
                node.holders = SmallVec::new();
                let moved = (
                    std::mem::take(&mut node.tokens),
                    std::mem::take(&mut node.pos),
                    node.children,
                    node.child,
                );
                node.children = 0;
                node.child = NO_CHILD;
                moved
            })?;
            self.with_node(p, |pn| {
                pn.tokens.extend(tokens);
                pn.pos.extend(pos);
                pn.children = children;
                pn.child = child;
            });
            self.edges.remove(&(p, c_first));
            if child != NO_CHILD {
                self.reparent(child, c, p);
            }
            self.free_nodes.push(c);
            self.relocate_from(p, p_len);
            return Some(p);
        }
        let (tokens, pos) = self.with_node(p, |pn| {
            pn.holders = SmallVec::new();
            pn.children = 0;
            pn.child = NO_CHILD;
            (std::mem::take(&mut pn.tokens), std::mem::take(&mut pn.pos))
        })?;
        self.with_node(c, |node| {
            node.tokens.splice(0..0, tokens);
            node.pos.splice(0..0, pos);
            node.parent = grand;
        });
        self.with_node(grand, |gn| {
            if gn.child == p {
                gn.child = c;
            }
        });
        self.edges.remove(&(p, c_first));
        if let Some(e) = self.edges.get_mut(&(grand, p_first)) {
            *e = c;
        }
        self.free_nodes.push(p);
        self.relocate_from(c, 0);
        Some(c)
    }

    /// Frees run `n`, then each ancestor, while one is held by no rank and has no
    /// child.
    fn free_up(&mut self, mut n: u32) {
        while n != ROOT {
            let Some(node) = self.node(n) else {
                return;
            };
            if !node.holders.is_empty() || node.children > 0 {
                break;
            }
            let parent = node.parent;
            if let Some(&first) = node.tokens.first() {
                self.edges.remove(&(parent, first));
            }
            let pos = self
                .with_node(n, |node| {
                    node.holders = SmallVec::new();
                    node.tokens = Vec::new();
                    std::mem::take(&mut node.pos)
                })
                .unwrap_or_default();
            self.positions -= pos.len();
            self.free_locs.extend(pos);
            self.free_nodes.push(n);
            self.with_node(parent, |pn| {
                pn.children -= 1;
                if pn.child == n || pn.children != 1 {
                    pn.child = NO_CHILD;
                }
            });
            n = parent;
        }
        let len = self.edges.len();
        if self.edges_cap_seen > 1024 && len < self.edges_cap_seen / 4 {
            self.edges.shrink_to(len * 2);
            self.edges_cap_seen = self.edges.capacity();
        }
    }

    /// When at least three quarters of the positions or of the runs ever made are
    /// free (and there are more than [`COMPACT_FROM`] slots), renumbers the live
    /// ones from 0 and gives the rest back. Returns where each old position id
    /// went (indexed by old id), for the ranks' tables.
    pub(super) fn compact_if_sparse(&mut self) -> Option<Vec<u32>> {
        let runs = self.nodes.len() - self.free_nodes.len();
        let sparse = |live: usize, slots: usize| slots > COMPACT_FROM && live < slots / 4;
        if !sparse(self.positions, self.locs.len()) && !sparse(runs, self.nodes.len()) {
            return None;
        }
        let free: Vec<bool> = {
            let mut free = vec![false; self.nodes.len()];
            for &n in &self.free_nodes {
                if let Some(f) = free.get_mut(n as usize) {
                    *f = true;
                }
            }
            free
        };
        // New run ids in arena order (the root stays 0), then new position ids.
        let mut run_id = vec![u32::MAX; self.nodes.len()];
        let mut next = 0u32;
        for (old, id) in run_id.iter_mut().enumerate() {
            if !free.get(old).copied().unwrap_or(true) {
                *id = next;
                next += 1;
            }
        }
        let mut moved = vec![u32::MAX; self.locs.len()];
        let mut nodes = Vec::with_capacity(next as usize);
        let mut locs = Vec::with_capacity(self.positions);
        for (old, mut node) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            if free.get(old).copied().unwrap_or(true) {
                continue;
            }
            let new = run_id.get(old).copied().unwrap_or(ROOT);
            node.parent = run_id.get(node.parent as usize).copied().unwrap_or(ROOT);
            if node.child != NO_CHILD {
                node.child = run_id.get(node.child as usize).copied().unwrap_or(NO_CHILD);
            }
            for (offset, p) in node.pos.iter_mut().enumerate() {
                let id = locs.len() as u32;
                locs.push(Loc {
                    node: new,
                    offset: offset as u32,
                });
                if let Some(m) = moved.get_mut(*p as usize) {
                    *m = id;
                }
                *p = id;
            }
            nodes.push(node);
        }
        self.edges = FastMap::default();
        for (id, node) in nodes.iter().enumerate().skip(1) {
            if let Some(&first) = node.tokens.first() {
                self.edges.insert((node.parent, first), id as u32);
            }
        }
        self.edges_cap_seen = self.edges.capacity();
        self.nodes = nodes;
        self.locs = locs;
        self.free_nodes = Vec::new();
        self.free_locs = Vec::new();
        Some(moved)
    }

    /// Runs `f` on node `n`, keeping [`heap_bytes`](Self::heap_bytes) right.
    fn with_node<R>(&mut self, n: u32, f: impl FnOnce(&mut Node) -> R) -> Option<R> {
        let node = self.nodes.get_mut(n as usize)?;
        let before = node.heap();
        let r = f(node);
        self.heap_bytes = self.heap_bytes - before + node.heap();
        Some(r)
    }

    fn alloc_node(&mut self, node: Node) -> u32 {
        self.heap_bytes += node.heap();
        match self.free_nodes.pop() {
            Some(id) => {
                if let Some(cell) = self.nodes.get_mut(id as usize) {
                    *cell = node;
                }
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn alloc_loc(&mut self) -> u32 {
        match self.free_locs.pop() {
            Some(p) => p,
            None => {
                self.locs.push(Loc::default());
                (self.locs.len() - 1) as u32
            }
        }
    }

    fn set_loc(&mut self, p: u32, node: u32, offset: usize) {
        if let Some(l) = self.locs.get_mut(p as usize) {
            *l = Loc {
                node,
                offset: offset as u32,
            };
        }
    }

    /// Points run `n`'s positions from offset `from` on at it.
    fn relocate_from(&mut self, n: u32, from: usize) {
        let Some(node) = self.nodes.get(n as usize) else {
            return;
        };
        for (offset, &p) in node.pos.iter().enumerate().skip(from) {
            if let Some(l) = self.locs.get_mut(p as usize) {
                *l = Loc {
                    node: n,
                    offset: offset as u32,
                };
            }
        }
    }

    fn insert_edge(&mut self, key: (u32, TokensHash), child: u32) {
        self.edges.insert(key, child);
        self.edges_cap_seen = self.edges_cap_seen.max(self.edges.capacity());
    }
}

#[cfg(test)]
impl Tree {
    /// Panics where the tree's links disagree: every live run's edge, parent,
    /// child count and known child, every position's location, the counts.
    #[allow(clippy::panic, clippy::indexing_slicing)]
    pub(super) fn check(&self) {
        let free: std::collections::HashSet<u32> = self.free_nodes.iter().copied().collect();
        let mut children = vec![0u32; self.nodes.len()];
        let mut positions = 0;
        let mut heap = 0;
        for (id, node) in self.nodes.iter().enumerate() {
            let id = id as u32;
            heap += node.heap();
            if id == ROOT || free.contains(&id) {
                continue;
            }
            assert!(
                !node.tokens.is_empty() && node.tokens.len() <= MAX_RUN,
                "run {id}"
            );
            assert_eq!(node.tokens.len(), node.pos.len());
            assert_eq!(
                self.edges.get(&(node.parent, node.tokens[0])),
                Some(&id),
                "edge of {id}"
            );
            assert!(!free.contains(&node.parent), "parent of {id} is free");
            children[node.parent as usize] += 1;
            for (offset, &p) in node.pos.iter().enumerate() {
                let l = self.locs[p as usize];
                assert_eq!((l.node, l.offset as usize), (id, offset), "position {p}");
            }
            positions += node.pos.len();
            assert!(node.holders.windows(2).all(|w| w[0] < w[1]));
        }
        for (id, node) in self.nodes.iter().enumerate() {
            if free.contains(&(id as u32)) {
                continue;
            }
            assert_eq!(node.children, children[id], "children of {id}");
            if node.child != NO_CHILD {
                assert_eq!(node.children, 1);
                assert_eq!(self.nodes[node.child as usize].parent, id as u32);
            }
        }
        assert_eq!(self.edges.len(), self.nodes.len() - 1 - free.len());
        assert_eq!(positions, self.positions);
        assert_eq!(heap, self.heap_bytes);
    }
}
