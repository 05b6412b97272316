//! The radix index of the KV blocks each worker holds: a node is one block after one exact
//! prefix of local hashes; each node lists its holders with the block hash their KV events
//! use for it.

use std::collections::HashMap;

use super::KvIndexError;

/// One block of a stored event: the worker's name for it and the local hash of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    pub block_hash: u64,
    pub tokens_hash: u64,
}

/// A run of blocks stored after `parent` (None: at the start of a sequence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRun {
    pub parent: Option<u64>,
    pub blocks: Vec<StoredBlock>,
}

type NodeId = u32;
type WorkerSlot = u32;
const ROOT: NodeId = 0;
/// Children are kept in a vector up to this many, then in a map (the root and shared prefixes
/// fan out widely; most nodes have one child).
const FEW_CHILDREN: usize = 8;

#[derive(Debug)]
enum Children {
    Few(Vec<(u64, NodeId)>),
    Many(HashMap<u64, NodeId>),
}

impl Children {
    fn get(&self, tokens_hash: u64) -> Option<NodeId> {
        match self {
            Children::Few(entries) => entries
                .iter()
                .find(|(hash, _)| *hash == tokens_hash)
                .map(|(_, id)| *id),
            Children::Many(map) => map.get(&tokens_hash).copied(),
        }
    }

    fn insert(&mut self, tokens_hash: u64, id: NodeId) {
        match self {
            Children::Few(entries) if entries.len() < FEW_CHILDREN => {
                entries.push((tokens_hash, id))
            }
            Children::Few(entries) => {
                let mut map: HashMap<u64, NodeId> = entries.drain(..).collect();
                map.insert(tokens_hash, id);
                *self = Children::Many(map);
            }
            Children::Many(map) => {
                map.insert(tokens_hash, id);
            }
        }
    }

    fn remove(&mut self, tokens_hash: u64) {
        match self {
            Children::Few(entries) => entries.retain(|(hash, _)| *hash != tokens_hash),
            Children::Many(map) => {
                map.remove(&tokens_hash);
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Children::Few(entries) => entries.is_empty(),
            Children::Many(map) => map.is_empty(),
        }
    }

    fn ids(&self) -> Vec<NodeId> {
        match self {
            Children::Few(entries) => entries.iter().map(|(_, id)| *id).collect(),
            Children::Many(map) => map.values().copied().collect(),
        }
    }
}

#[derive(Debug)]
struct Node {
    tokens_hash: u64,
    parent: NodeId,
    children: Children,
    /// (worker slot, that worker's block hash for this node)
    holders: Vec<(WorkerSlot, u64)>,
}

impl Node {
    fn new(tokens_hash: u64, parent: NodeId) -> Self {
        Node {
            tokens_hash,
            parent,
            children: Children::Few(Vec::new()),
            holders: Vec::new(),
        }
    }

    fn holder(&self, slot: WorkerSlot) -> Option<u64> {
        self.holders
            .iter()
            .find(|(worker, _)| *worker == slot)
            .map(|(_, hash)| *hash)
    }
}

#[derive(Debug, Default)]
struct Worker {
    name: String,
    /// block hash -> node
    blocks: HashMap<u64, NodeId>,
}

/// Radix index of the KV blocks cached by each worker.
#[derive(Debug)]
pub struct KvIndex {
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    slots: HashMap<String, WorkerSlot>,
    workers: Vec<Option<Worker>>,
    free_slots: Vec<WorkerSlot>,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KvIndex {
    pub fn new() -> Self {
        KvIndex {
            nodes: vec![Node::new(0, ROOT)],
            free_nodes: Vec::new(),
            slots: HashMap::new(),
            workers: Vec::new(),
            free_slots: Vec::new(),
        }
    }

    /// Store `blocks` of `worker` in sequence order after `parent` (None: from the start).
    /// An unknown parent changes nothing and is an error: the index missed an event, and the
    /// worker should be resynchronised from a dump.
    pub fn apply_stored(
        &mut self,
        worker: &str,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), KvIndexError> {
        let slot = self.slot_or_insert(worker);
        let mut node = match parent {
            None => ROOT,
            Some(parent_hash) => match self.worker(slot).blocks.get(&parent_hash) {
                Some(&id) => id,
                None => {
                    return Err(KvIndexError::UnknownParent {
                        worker: worker.to_owned(),
                        parent: parent_hash,
                    })
                }
            },
        };
        for block in blocks {
            let child = match self.nodes[node as usize].children.get(block.tokens_hash) {
                Some(id) => id,
                None => self.add_node(block.tokens_hash, node),
            };
            let holders = &mut self.nodes[child as usize].holders;
            let renamed = match holders.iter_mut().find(|(worker, _)| *worker == slot) {
                Some(entry) => Some(std::mem::replace(&mut entry.1, block.block_hash)),
                None => {
                    holders.push((slot, block.block_hash));
                    None
                }
            };
            // Another name for this node, or this name on another node, is stale. The child is
            // held by now, so dropping a stale holder never prunes it.
            if let Some(old_hash) = renamed.filter(|old| *old != block.block_hash) {
                self.worker_mut(slot).blocks.remove(&old_hash);
            }
            if let Some(old_node) = self.worker_mut(slot).blocks.insert(block.block_hash, child) {
                if old_node != child {
                    self.drop_holder(old_node, slot);
                }
            }
            node = child;
        }
        Ok(())
    }

    /// Forget the named blocks of `worker`; unknown names are ignored.
    pub fn apply_removed(&mut self, worker: &str, block_hashes: &[u64]) {
        let Some(&slot) = self.slots.get(worker) else {
            return;
        };
        for hash in block_hashes {
            if let Some(node) = self.worker_mut(slot).blocks.remove(hash) {
                self.drop_holder(node, slot);
            }
        }
    }

    /// Forget every block of `worker` (its cache was cleared); it stays known.
    pub fn clear_worker(&mut self, worker: &str) {
        let Some(&slot) = self.slots.get(worker) else {
            return;
        };
        let blocks = std::mem::take(&mut self.worker_mut(slot).blocks);
        for node in blocks.into_values() {
            self.drop_holder(node, slot);
        }
    }

    /// Forget `worker` and its blocks (it left the deployment).
    pub fn remove_worker(&mut self, worker: &str) {
        self.clear_worker(worker);
        if let Some(slot) = self.slots.remove(worker) {
            self.workers[slot as usize] = None;
            self.free_slots.push(slot);
        }
    }

    /// Overlap in blocks per worker with the sequence of local hashes; workers without
    /// overlap are left out.
    pub fn find_matches(&self, local_hashes: &[u64]) -> Vec<(&str, usize)> {
        let mut scores: Vec<(WorkerSlot, usize)> = Vec::new();
        let mut active: Vec<WorkerSlot> = Vec::new();
        // seen[slot] == depth + 1 when the worker holds the node at `depth`
        let mut seen = vec![0usize; self.workers.len()];
        let mut node = ROOT;
        let mut depth = 0;
        for &local in local_hashes {
            let Some(child) = self.nodes[node as usize].children.get(local) else {
                break;
            };
            let holders = &self.nodes[child as usize].holders;
            if depth == 0 {
                active.extend(holders.iter().map(|(slot, _)| *slot));
            } else {
                for (slot, _) in holders {
                    seen[*slot as usize] = depth + 1;
                }
                active.retain(|slot| {
                    let holds = seen[*slot as usize] == depth + 1;
                    if !holds {
                        scores.push((*slot, depth));
                    }
                    holds
                });
            }
            if active.is_empty() {
                break;
            }
            depth += 1;
            node = child;
        }
        scores.extend(active.into_iter().map(|slot| (slot, depth)));
        scores
            .into_iter()
            .map(|(slot, overlap)| (self.worker(slot).name.as_str(), overlap))
            .collect()
    }

    /// `worker`'s blocks as stored runs that rebuild them in an empty index: each run is an
    /// unbranched path whose parent is None or the last block of an earlier run. Blocks held
    /// below a block the worker does not hold are left out (they cannot count to an overlap).
    pub fn dump(&self, worker: &str) -> Vec<StoredRun> {
        let Some(&slot) = self.slots.get(worker) else {
            return Vec::new();
        };
        let mut runs = Vec::new();
        let mut stack: Vec<(Option<u64>, NodeId)> = vec![(None, ROOT)];
        while let Some((parent, node)) = stack.pop() {
            for first in self.held_children(node, slot) {
                let mut path = vec![first];
                loop {
                    let next = self.held_children(path[path.len() - 1], slot);
                    match next.as_slice() {
                        [only] => path.push(*only),
                        _ => break,
                    }
                }
                let blocks: Vec<StoredBlock> = path
                    .iter()
                    .filter_map(|&id| {
                        let node = &self.nodes[id as usize];
                        node.holder(slot).map(|block_hash| StoredBlock {
                            block_hash,
                            tokens_hash: node.tokens_hash,
                        })
                    })
                    .collect();
                let last = path[path.len() - 1];
                let last_hash = blocks.last().map(|block| block.block_hash);
                runs.push(StoredRun { parent, blocks });
                stack.push((last_hash, last));
            }
        }
        runs
    }

    /// Workers with events applied and not removed.
    pub fn workers(&self) -> Vec<&str> {
        self.workers
            .iter()
            .flatten()
            .map(|worker| worker.name.as_str())
            .collect()
    }

    pub fn num_blocks(&self, worker: &str) -> usize {
        self.slots
            .get(worker)
            .map_or(0, |&slot| self.worker(slot).blocks.len())
    }

    /// Nodes in the tree, the root excluded.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - 1 - self.free_nodes.len()
    }

    fn held_children(&self, node: NodeId, slot: WorkerSlot) -> Vec<NodeId> {
        self.nodes[node as usize]
            .children
            .ids()
            .into_iter()
            .filter(|&child| self.nodes[child as usize].holder(slot).is_some())
            .collect()
    }

    fn slot_or_insert(&mut self, worker: &str) -> WorkerSlot {
        if let Some(&slot) = self.slots.get(worker) {
            return slot;
        }
        let entry = Worker {
            name: worker.to_owned(),
            blocks: HashMap::new(),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(entry);
                slot
            }
            None => {
                self.workers.push(Some(entry));
                (self.workers.len() - 1) as WorkerSlot
            }
        };
        self.slots.insert(worker.to_owned(), slot);
        slot
    }

    // Slots in `slots` always point at a live worker; these accessors rely on that invariant.
    #[allow(
        clippy::expect_used,
        reason = "slots are freed only together with their `slots` entry"
    )]
    fn worker(&self, slot: WorkerSlot) -> &Worker {
        self.workers[slot as usize]
            .as_ref()
            .expect("slot of a live worker")
    }

    #[allow(
        clippy::expect_used,
        reason = "slots are freed only together with their `slots` entry"
    )]
    fn worker_mut(&mut self, slot: WorkerSlot) -> &mut Worker {
        self.workers[slot as usize]
            .as_mut()
            .expect("slot of a live worker")
    }

    fn add_node(&mut self, tokens_hash: u64, parent: NodeId) -> NodeId {
        let node = Node::new(tokens_hash, parent);
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        };
        self.nodes[parent as usize].children.insert(tokens_hash, id);
        id
    }

    fn drop_holder(&mut self, node: NodeId, slot: WorkerSlot) {
        self.nodes[node as usize]
            .holders
            .retain(|(worker, _)| *worker != slot);
        // Free nodes nobody holds and nothing hangs from, up towards the root.
        let mut id = node;
        while id != ROOT {
            let current = &self.nodes[id as usize];
            if !current.holders.is_empty() || !current.children.is_empty() {
                break;
            }
            let (parent, tokens_hash) = (current.parent, current.tokens_hash);
            self.nodes[parent as usize].children.remove(tokens_hash);
            self.nodes[id as usize] = Node::new(0, ROOT);
            self.free_nodes.push(id);
            id = parent;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::compute_seq_hashes;

    fn chain(local: &[u64]) -> Vec<StoredBlock> {
        compute_seq_hashes(local, None)
            .into_iter()
            .zip(local)
            .map(|(block_hash, &tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect()
    }

    fn scores(index: &KvIndex, local: &[u64]) -> Vec<(String, usize)> {
        let mut found: Vec<(String, usize)> = index
            .find_matches(local)
            .into_iter()
            .map(|(name, overlap)| (name.to_owned(), overlap))
            .collect();
        found.sort();
        found
    }

    #[test]
    fn unknown_parent_changes_nothing() {
        let mut index = KvIndex::new();
        let err = index.apply_stored("w", Some(9), &chain(&[1])).unwrap_err();
        assert_eq!(err.code(), "kv_index.unknown_parent");
        assert_eq!(index.num_blocks("w"), 0);
    }

    #[test]
    fn overlap_stops_at_first_gap_and_first_difference() {
        let mut index = KvIndex::new();
        index
            .apply_stored("a", None, &chain(&[1, 2, 3, 4]))
            .unwrap();
        index.apply_stored("b", None, &chain(&[1, 2, 9])).unwrap();
        assert_eq!(
            scores(&index, &[1, 2, 3, 4, 5]),
            vec![("a".into(), 4), ("b".into(), 2)]
        );
        // Removing a's block 2 leaves it a one-block prefix.
        let a_blocks = chain(&[1, 2, 3, 4]);
        index.apply_removed("a", &[a_blocks[1].block_hash]);
        assert_eq!(
            scores(&index, &[1, 2, 3, 4]),
            vec![("a".into(), 1), ("b".into(), 2)]
        );
        assert_eq!(scores(&index, &[7]), vec![]);
    }

    #[test]
    fn stored_after_parent_extends_the_chain() {
        let mut index = KvIndex::new();
        let blocks = chain(&[1, 2, 3]);
        index.apply_stored("a", None, &blocks[..1]).unwrap();
        index
            .apply_stored("a", Some(blocks[0].block_hash), &blocks[1..])
            .unwrap();
        assert_eq!(scores(&index, &[1, 2, 3]), vec![("a".into(), 3)]);
        assert_eq!(index.num_blocks("a"), 3);
    }

    #[test]
    fn clear_and_remove_worker_prune_the_tree() {
        let mut index = KvIndex::new();
        index.apply_stored("a", None, &chain(&[1, 2, 3])).unwrap();
        index.apply_stored("b", None, &chain(&[1, 2])).unwrap();
        assert_eq!(index.num_nodes(), 3);
        index.clear_worker("a");
        assert_eq!(index.num_nodes(), 2);
        assert_eq!(index.workers(), vec!["a", "b"]);
        index.remove_worker("b");
        assert_eq!(index.num_nodes(), 0);
        assert_eq!(index.workers(), vec!["a"]);
        assert_eq!(scores(&index, &[1, 2]), vec![]);
    }

    #[test]
    fn removed_worker_slot_is_reused_cleanly() {
        let mut index = KvIndex::new();
        index.apply_stored("a", None, &chain(&[1, 2])).unwrap();
        index.remove_worker("a");
        index.apply_stored("c", None, &chain(&[1])).unwrap();
        assert_eq!(scores(&index, &[1, 2]), vec![("c".into(), 1)]);
    }

    #[test]
    fn dump_rebuilds_the_same_index() {
        let mut index = KvIndex::new();
        let trunk = chain(&[1, 2, 3]);
        index.apply_stored("a", None, &trunk).unwrap();
        let branch = compute_seq_hashes(&[7, 8], Some(trunk[1].block_hash));
        let branch_blocks: Vec<StoredBlock> = branch
            .iter()
            .zip([7u64, 8])
            .map(|(&block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect();
        index
            .apply_stored("a", Some(trunk[1].block_hash), &branch_blocks)
            .unwrap();
        index.apply_stored("a", None, &chain(&[5])).unwrap();
        index.apply_stored("b", None, &chain(&[1, 2, 3])).unwrap();

        let runs = index.dump("a");
        let mut rebuilt = KvIndex::new();
        for run in &runs {
            rebuilt.apply_stored("a", run.parent, &run.blocks).unwrap();
        }
        assert_eq!(rebuilt.num_blocks("a"), 6);
        for query in [&[1u64, 2, 3][..], &[1, 2, 7, 8], &[5], &[1, 9]] {
            assert_eq!(
                scores(&rebuilt, query),
                scores(&index, query)
                    .into_iter()
                    .filter(|(name, _)| name == "a")
                    .collect::<Vec<_>>()
            );
        }
        // The shared prefix [1, 2] is one run; each branch continues it.
        assert_eq!(runs.len(), 4);
        assert_eq!(index.dump("nobody"), vec![]);
    }

    #[test]
    fn renamed_block_drops_the_old_name() {
        let mut index = KvIndex::new();
        let first = StoredBlock {
            block_hash: 100,
            tokens_hash: 1,
        };
        let renamed = StoredBlock {
            block_hash: 200,
            tokens_hash: 1,
        };
        index.apply_stored("a", None, &[first]).unwrap();
        index.apply_stored("a", None, &[renamed]).unwrap();
        assert_eq!(index.num_blocks("a"), 1);
        index.apply_removed("a", &[100]);
        assert_eq!(scores(&index, &[1]), vec![("a".into(), 1)]);
        index.apply_removed("a", &[200]);
        assert_eq!(index.num_nodes(), 0);
    }
}
