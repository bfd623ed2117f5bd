// Helpers of scripts/ops-check for the Grafana dashboard (Node.js, no dependencies).
//
//   node dashboard.mjs exprs DASHBOARD.json        one JSON line per query target:
//                                                  {panel, refId, expr, promql} where promql has the
//                                                  Grafana variables replaced (all instances and
//                                                  partitions, $__rate_interval = 30s)
//   node dashboard.mjs rules DASHBOARD.json        the queries as a Prometheus rules file (one
//                                                  recording rule each), for `promtool check rules`
//   node dashboard.mjs variables DASHBOARD.json    one JSON line per query variable: {name, metric, label}
//   node dashboard.mjs tscheck DASHBOARD.json OUT.ts [--break]
//                                                  writes a TypeScript file that assigns the dashboard
//                                                  (and each panel's options) to @grafana/schema's
//                                                  types; --break adds an unknown property (the
//                                                  negative control: tsc must reject it)
//   node dashboard.mjs result FILE.json            checks a `promtool query instant -o json` answer:
//                                                  at least one series, at least one finite value

import { readFileSync, writeFileSync } from 'node:fs';

const [cmd, file, out, flag] = process.argv.slice(2);

function load() {
  return JSON.parse(readFileSync(file, 'utf8'));
}

/** Every panel, rows' nested panels included. */
function allPanels(d) {
  const ps = [];
  for (const p of d.panels ?? []) {
    ps.push(p);
    for (const c of p.panels ?? []) ps.push(c);
  }
  return ps;
}

/** The PromQL that Grafana sends when every variable is at "All". */
export function substitute(expr) {
  return expr
    .replaceAll('$__rate_interval', '30s')
    .replaceAll('${__rate_interval}', '30s')
    .replaceAll('$__interval', '15s')
    .replace(/\$\{?instance\}?/g, '.*')
    .replace(/\$\{?partition\}?/g, '.*');
}

function exprs(d) {
  const rows = [];
  for (const p of allPanels(d)) {
    for (const t of p.targets ?? []) {
      if (typeof t.expr !== 'string') continue;
      rows.push({ panel: p.title, refId: t.refId, expr: t.expr, promql: substitute(t.expr) });
    }
  }
  return rows;
}

switch (cmd) {
  case 'exprs':
    for (const r of exprs(load())) console.log(JSON.stringify(r));
    break;

  case 'rules': {
    // YAML is a superset of JSON: a JSON rules file is a valid Prometheus rules file.
    const rules = exprs(load()).map((r, i) => ({ record: `dashboard:query_${i}`, expr: r.promql }));
    console.log(JSON.stringify({ groups: [{ name: 'dashboard-queries', rules }] }, null, 2));
    break;
  }

  case 'variables':
    for (const v of load().templating?.list ?? []) {
      if (v.type !== 'query') continue;
      const q = typeof v.query === 'string' ? v.query : v.query?.query;
      const m = /^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$/.exec(q ?? '');
      if (!m) {
        console.error(`variable ${v.name}: not a label_values(metric, label) query: ${q}`);
        process.exit(1);
      }
      console.log(JSON.stringify({ name: v.name, metric: m[1].trim(), label: m[2] }));
    }
    break;

  case 'tscheck': {
    const d = load();
    // Import-only metadata (`__inputs`, `__requires`) is not part of the dashboard model.
    const { __inputs, __requires, ...model } = d;
    if (flag === '--break') model.panels[1].notAPanelField = true;
    const lit = (v) => JSON.stringify(v, null, 2);
    const lines = [
      "import type { Dashboard } from '@grafana/schema';",
      "import type { Options as TimeSeriesOptions, FieldConfig as TimeSeriesFieldConfig } from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';",
      "import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';",
      '',
      '// The schema declares string enums (e.g. BigValueColorMode); JSON holds their string values.',
      '// Loose<T> turns every enum into the union of its values and keeps everything else as is,',
      '// including excess-property checks on object literals.',
      'type Loose<T> = T extends string ? `${T}` : T extends number | boolean | null | undefined ? T : T extends (infer E)[] ? Loose<E>[] : T extends object ? { [K in keyof T]: Loose<T[K]> } : T;',
      '',
      'interface ImportInput { name: string; label: string; description?: string; type: "datasource"; pluginId: string; pluginName: string }',
      'interface ImportRequire { type: "grafana" | "datasource" | "panel"; id: string; name: string; version: string }',
      `export const inputs: ImportInput[] = ${lit(__inputs ?? [])};`,
      `export const requires: ImportRequire[] = ${lit(__requires ?? [])};`,
      `export const dashboard: Loose<Dashboard> = ${lit(model)};`,
    ];
    allPanels(model).forEach((p, i) => {
      if (p.type === 'timeseries') {
        lines.push(`export const panel${i}_options: Loose<TimeSeriesOptions> = ${lit(p.options)};`);
        lines.push(`export const panel${i}_custom: Loose<TimeSeriesFieldConfig> = ${lit(p.fieldConfig?.defaults?.custom ?? {})};`);
      } else if (p.type === 'stat') {
        lines.push(`export const panel${i}_options: Loose<StatOptions> = ${lit(p.options)};`);
      } else if (p.type !== 'row') {
        lines.push(`// panel ${i} (${p.type}): options not checked`);
        console.error(`warning: panel type ${p.type} has no options check`);
      }
    });
    writeFileSync(out, lines.join('\n') + '\n');
    break;
  }

  case 'result': {
    const r = JSON.parse(readFileSync(file, 'utf8'));
    const series = Array.isArray(r) ? r : r?.data?.result ?? [];
    const values = series.map((s) => Number((s.value ?? [])[1]));
    const finite = values.filter((v) => Number.isFinite(v));
    if (series.length === 0) {
      console.log('no series');
      process.exit(1);
    }
    if (finite.length === 0) {
      console.log(`${series.length} series, none with a finite value (${values.join(', ')})`);
      process.exit(1);
    }
    console.log(`${series.length} series, e.g. ${finite[0]}`);
    break;
  }

  default:
    console.error('usage: dashboard.mjs exprs|rules|variables|tscheck|result FILE [OUT] [--break]');
    process.exit(2);
}
