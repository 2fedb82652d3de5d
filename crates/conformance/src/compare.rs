//! One comparer for both eras' traces: what llama.cpp shows after an op against what our cache
//! shows, field by field, each difference one line that names the field and both values.
//! The seed's observations ([`crate::seed::trace::Obs`]) and today's
//! ([`crate::today::trace::Shown`]) each say which fields they have ([`Observation`]).

use std::fmt::Debug;

/// Lines of one comparison, at most.
const MAX_LINES: usize = 40;
/// Differing items of one list named, at most.
const MAX_ITEMS: usize = 12;

/// The differences found so far, one line each.
pub struct Diff {
    peer: &'static str,
    lines: Vec<String>,
}

impl Diff {
    /// An empty comparison against `peer` (how the lines name llama.cpp's side).
    pub fn new(peer: &'static str) -> Diff {
        Diff {
            peer,
            lines: Vec::new(),
        }
    }

    /// A field: one line when the sides differ.
    pub fn field<T: PartialEq + Debug + ?Sized>(&mut self, name: &str, theirs: &T, ours: &T) {
        if theirs != ours {
            self.lines
                .push(format!("{name}: {} {theirs:?}, ours {ours:?}", self.peer));
        }
    }

    /// A list compared item by item (`name` of each item from its index): the first items
    /// that differ, then how many do; lists of other lengths give one line.
    pub fn items<T: PartialEq + Debug>(
        &mut self,
        name: impl Fn(usize) -> String,
        what: &str,
        theirs: &[T],
        ours: &[T],
    ) {
        if theirs.len() != ours.len() {
            self.field(what, &theirs.len(), &ours.len());
            return;
        }
        let bad: Vec<usize> = (0..theirs.len())
            .filter(|&i| theirs[i] != ours[i])
            .collect();
        for &i in bad.iter().take(MAX_ITEMS) {
            self.field(&name(i), &theirs[i], &ours[i]);
        }
        if bad.len() > MAX_ITEMS {
            self.lines
                .push(format!("... {} {what} differ in all", bad.len()));
        }
    }

    /// A difference the caller words itself.
    pub fn line(&mut self, line: String) {
        self.lines.push(line);
    }

    /// How llama.cpp's side is named.
    pub fn peer(&self) -> &'static str {
        self.peer
    }

    /// The lines (empty: the sides agree).
    pub fn lines(mut self) -> Vec<String> {
        self.lines.truncate(MAX_LINES);
        self.lines
    }
}

/// What a side shows after an op, compared field by field.
pub trait Observation {
    /// Adds a line to `d` for each field where `ours` differs from `self` (llama.cpp's).
    fn compare(&self, ours: &Self, d: &mut Diff);
}

/// The differences between llama.cpp's observation and ours, one line each (empty: equal).
pub fn diff<O: Observation>(peer: &'static str, theirs: &O, ours: &O) -> Vec<String> {
    let mut d = Diff::new(peer);
    theirs.compare(ours, &mut d);
    d.lines()
}
