// Helper of scripts/ops-check: are the system calls a process made allowed by a unit's
// SystemCallFilter= lines? (Node.js, no dependencies.)
//
//   node syscalls.mjs GROUPS.txt STRACE_SUMMARY.txt UNIT_FILE
//
// GROUPS.txt: the output of `systemd-analyze syscall-filter` (every group, nested groups by name).
// STRACE_SUMMARY.txt: the table of `strace -f -c -o FILE …`.
// UNIT_FILE: its SystemCallFilter= lines are applied as systemd does: the first allow-list sets
// the allowed calls, a later `~` line removes calls from them, a later plain line adds.
// Prints the calls made and exits 1 when one of them is not allowed.

import { readFileSync } from 'node:fs';

const [groupsFile, straceFile, unitFile] = process.argv.slice(2);

const groups = new Map();
let current = null;
for (const line of readFileSync(groupsFile, 'utf8').split('\n')) {
  if (/^@\S+/.test(line)) {
    current = line.trim();
    groups.set(current, []);
  } else if (current && line.trim() && !line.trim().startsWith('#')) {
    groups.get(current).push(line.trim());
  }
}

function expand(name, seen = new Set()) {
  if (!name.startsWith('@')) return [name];
  if (seen.has(name)) return [];
  seen.add(name);
  const members = groups.get(name);
  if (!members) throw new Error(`unknown syscall group ${name}`);
  return members.flatMap((m) => expand(m, seen));
}

let allowed = null;
for (const line of readFileSync(unitFile, 'utf8').split('\n')) {
  const m = /^\s*SystemCallFilter=(.*)$/.exec(line);
  if (!m) continue;
  let spec = m[1].trim();
  const deny = spec.startsWith('~');
  if (deny) spec = spec.slice(1);
  const calls = spec.split(/\s+/).filter(Boolean).flatMap((n) => expand(n));
  if (allowed === null) {
    if (deny) throw new Error('a deny-list first is not handled here');
    allowed = new Set(calls);
  } else if (deny) {
    for (const c of calls) allowed.delete(c);
  } else {
    for (const c of calls) allowed.add(c);
  }
}
if (allowed === null) throw new Error(`${unitFile}: no SystemCallFilter=`);

const used = [];
for (const line of readFileSync(straceFile, 'utf8').split('\n')) {
  const cols = line.trim().split(/\s+/);
  const name = cols[cols.length - 1];
  if (cols.length >= 5 && /^[0-9.]+$/.test(cols[0]) && name !== 'total' && /^[a-z_0-9]+$/.test(name)) used.push(name);
}
if (used.length === 0) {
  console.log('no system calls found in the strace summary');
  process.exit(1);
}
const denied = used.filter((c) => !allowed.has(c));
console.log(`${used.length} distinct system calls made: ${used.sort().join(' ')}`);
if (denied.length > 0) {
  console.log(`NOT allowed by the unit's SystemCallFilter: ${denied.join(' ')}`);
  process.exit(1);
}
console.log(`all allowed by the unit's SystemCallFilter (${allowed.size} calls allowed)`);
